"""`duet loadtest hostile`: bounded probes that send what a hostile client would, each with the
verdict it expects (a FAIL is a finding about the server). See loadtest/hostile/README.md."""
