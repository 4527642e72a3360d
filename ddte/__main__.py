import sys

from ddte.cli import main

sys.exit(main())
