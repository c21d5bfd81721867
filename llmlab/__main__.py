import sys

from llmlab.cli import main

sys.exit(main())
