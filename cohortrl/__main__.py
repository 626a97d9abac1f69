import sys

from cohortrl.cli import main

sys.exit(main())
