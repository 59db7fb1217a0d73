from tpcheck.cli import entry

entry()
