"""`duet bench`: the engine's benchmark suite (suite.py); its figures: docs/performance/."""


def main(argv=None):
    """`duet bench` (kept light: the suite imports torch)."""
    from .suite import main as suite_main
    return suite_main(argv)
