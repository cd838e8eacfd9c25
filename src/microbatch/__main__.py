import sys

from microbatch.cli import main

sys.exit(main())
