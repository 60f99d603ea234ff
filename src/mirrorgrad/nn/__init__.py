"""Drop-in replacements for torch.nn recurrent modules."""

from mirrorgrad.nn import functional

__all__ = ["functional"]
