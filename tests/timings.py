"""What two runs of the same command must agree on (a plain module beside paths.py and mutants.py,
for the tests of every folder)."""


def without_timings(value):
    """The report with every `seconds` key removed:
    what two runs of the same command must agree on."""
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k != "seconds"}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value
