"""Multi-turn workloads: conversations replayed turn by turn, each turn's prompt the whole
history so far, reported by turn index (`duet loadtest multiturn`)."""
