"""Model ids: a GGUF named by the hash of its manifest, so any piece of it can be checked on its own
(``manifest``: pure; ``local``: a file's manifest, computed once and kept)."""

from meshnode.errors import ManifestError
from meshnode.modelid.local import manifest_of, model_id
from meshnode.modelid.manifest import Manifest, parse

__all__ = ["Manifest", "ManifestError", "manifest_of", "model_id", "parse"]
