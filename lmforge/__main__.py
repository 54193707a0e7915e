from lmforge.cli import exit_now, main
from lmforge.launch import record_status

code = main()
record_status(code)  # (under `lmforge launch`: for the launcher, which a signal may end before its agent reports)
exit_now(code)
