"""The fork server's first preload: the test process's ``sys.path``, before anything else is
imported (tests/multirank.py, ``start_fork_server``).

Python 3.11's fork server starts as ``python -c ...`` with the current directory first on its
path and does not take its parent's. From a repository root, with zerofx installed (not
editable, as tox installs it), importing ``zerofx`` there found the source tree's ``zerofx/``,
which lacks ``zerofx.passes``: the import failed (the server skips a preload that fails) after
some of its submodules had loaded, and every rank forked from it then mixed those with the
installed package's."""

import os
import sys

_paths = os.environ.get("ZEROFX_FORKSERVER_SYS_PATH")
if _paths is not None:
    sys.path[:] = _paths.split(os.pathsep)
