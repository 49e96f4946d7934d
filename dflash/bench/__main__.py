import sys

from .. import cli
from . import main

sys.exit(cli.run(main))
