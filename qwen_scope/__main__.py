import sys

from qwen_scope.cli import main

sys.exit(main())
