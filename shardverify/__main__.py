import sys

from shardverify.cli.main import main

if __name__ == "__main__":   # not in a child process multiprocessing spawns (it imports this module)
    sys.exit(main())
