from ..errors import KtError


class PlacementError(KtError):
    """Bad placement options, budget or expert-statistics file."""
