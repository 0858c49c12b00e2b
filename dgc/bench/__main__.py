"""``python -m dgc.bench {select,wire,ops,cluster,gpu} [options]``; see :mod:`dgc.bench`."""

import sys

from dgc.bench import main

if __name__ == "__main__":
    sys.exit(main())
