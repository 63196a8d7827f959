class WeightsError(ValueError):
    """A weight file or directory that cannot be used as it is: the message is one
    line that names the file and what is wrong with it."""
