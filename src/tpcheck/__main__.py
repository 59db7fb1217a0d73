import os
import sys

from tpcheck.cli import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)  # skip torch's slow interpreter exit (and gloo's occasional abort in it)
