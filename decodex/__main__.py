import sys

from decodex.cli import main

sys.exit(main())
