"""`python -m tfdist -- command ...`: run `command` with this rank's early settings in place.

What `tfdist-run` starts every rank with (see `tfdist.tuning.startup`): oneDNN, thread pools, OpenMP
variables and core pinning are set for this rank, then the command replaces this process.

```bash
horovodrun -np 2 --gloo python -m tfdist -- python train.py
```
"""

import sys

from tfdist.tuning import startup

if __name__ == "__main__":
    sys.exit(startup.main())
