"""`python -m hpcrl.dashboard DIR ...` = `hpcrl dashboard DIR ...`."""

import sys

from hpcrl.dashboard.serve import main
from hpcrl.errors import user_errors

if __name__ == "__main__":  # importing it (scripts/pip.sh warms every module's bytecode) runs nothing
    sys.exit(user_errors(lambda: main(sys.argv[1:])))
