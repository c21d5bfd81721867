import sys

from llmlab.ops.cli import main

sys.exit(main())
