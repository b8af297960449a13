import sys

from meshnode.cli.main import main

sys.exit(main())
