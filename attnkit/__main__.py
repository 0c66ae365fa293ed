"""`python -m attnkit`. A folder named attnkit in the working directory is a namespace package that shadows an
editable install (setuptools' import hook comes after it); it is set aside so the installed attnkit runs."""

import os
import sys

if getattr(sys.modules.get("attnkit"), "__file__", None) is None:
    del sys.modules["attnkit"]
    sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]

from attnkit.cli import main  # noqa: E402

main()
