"""The CLI's exit contract (docs/design.md, "The command line contract"), as exceptions library code can raise.

    0    done
    1    CheckFailed: a check or verification failed (the data disagrees with what was recorded)
    2    ValueError / TypeError / OSError: bad input or environment (the message names the path and the fix)
    130  KeyboardInterrupt: interrupted, after cleanup

`bridge.cli.main` maps these to exit codes and prints one `error: ...` line (a traceback only with --debug).
"""


class CheckFailed(Exception):
    """A check or verification failed: exit 1 (a checksum differs, numbers disagree)."""
