import sys

from lmforge.cli import main
from lmforge.launch import record_status

code = main()
record_status(code)  # (under `lmforge launch`: for the launcher, which a signal may end before its agent reports)
sys.exit(code)
