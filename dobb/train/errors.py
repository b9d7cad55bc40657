"""Failures a run's input causes, kept apart from bugs.

`RunError` is raised for what the user can fix (a config key, the data, a damaged
checkpoint, an `out_dir` in use, a layout launched without torchrun); its message is one
line saying what was wrong and how to fix it. The `dobb` command prints it as
`dobb: error: <message>` and exits with status 2 (so does a divergence); any other
exception is a bug. `RunWarning` is something a run's user should read (a checkpoint skipped,
a config changed on resume); the command prints it as `dobb: warning: <message>`.
"""


class RunError(Exception):
    """An expected failure caused by the run's input; the message names the fix."""


class RunWarning(UserWarning):
    """A warning about the run's input that the user should act on or know about."""
