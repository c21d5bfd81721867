"""``python -m llmlab.serve.proxy``."""

import sys

from llmlab.serve.proxy.command import main

sys.exit(main())
