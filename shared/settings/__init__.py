"""Settings declared once: a dataclass field names its flag, its DUET_* variable, its parser,
default and help (spec.py; value parsers in parsers.py). From that come the argparse flags of
every command and the dataclass built back from them (flags.py), and the table of every
environment variable that `duet env` prints (catalog.py). process_vars.py declares the few
variables read outside a settings dataclass; drain.py the drain grace several services share.
No imports here: importing a submodule stays light."""
