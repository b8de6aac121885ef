"""Settings declared once: a dataclass field names its flag, its DUET_* variable, its parser,
default and help (spec.py); from that come the argparse flags of every command (flags.py) and
the table of every environment variable (catalog.py). Light: no imports here."""
