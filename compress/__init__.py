"""compress: model-compression toolkit for Hugging Face checkpoints.

Public API: :func:`load`. Importing this package never imports triton or touches CUDA; it
arranges for the transformers quantizers of compress's formats to be registered as soon as
transformers' quantizer registry is imported (see ``compress.formats.hf``).
"""

__version__ = "0.1.0"

from compress.formats.hf import install_hook as _install_hook, load  # noqa: E402

_install_hook()

__all__ = ["load", "__version__"]
