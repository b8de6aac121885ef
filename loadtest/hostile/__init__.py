"""`duet loadtest hostile`: bounded probes that send what a hostile client would, and record
how the gateway answers (status, OpenAI error JSON or not, latency, its memory, /health
latency while the probe runs, a victim's latency, decode KV after a disconnect).

Each probe carries the verdict it expects and says PASS or FAIL; a FAIL is a finding about
the server, not an error of the suite. See loadtest/hostile/README.md."""
