import sys

from datapipe.cli import main

sys.exit(main())
