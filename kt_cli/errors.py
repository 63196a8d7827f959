class KtError(Exception):
    """An error meant for the user: the CLI prints its message as one line on
    stderr and exits non-zero, without a traceback."""

    exit_code = 2


class KernelLoadError(KtError):
    pass


class ModelError(KtError):
    pass
