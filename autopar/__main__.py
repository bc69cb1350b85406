import sys

from autopar.cli import main

sys.exit(main())
