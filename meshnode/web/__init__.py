"""meshnode's web pages: the chat page of every API and the mesh map of the tracker and the API.

The pages are static files in ``static/`` (HTML, JS, CSS, and the third-party
code vendored from npm in ``static/vendor/``, see its VENDORED.md), served
from the app's own origin under ``/assets`` with a Content-Security-Policy
that allows nothing else (``assets.py``). Every dynamic thing they show comes
from the JSON APIs they poll or stream; model output and anything a node
advertised reach the DOM as text, or as markdown sanitized by DOMPurify.
"""

from meshnode.web.assets import CSP, asset_mount, page, secure

__all__ = ["CSP", "asset_mount", "page", "secure"]
