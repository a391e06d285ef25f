"""FP8/FP4 training recipes under TransformerEngine's import path: twinspec.recipe's, the one definition jaxside takes too."""

from twinspec.recipe import *  # noqa: F403
from twinspec.recipe import __all__  # noqa: F401
