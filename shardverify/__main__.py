import sys

from shardverify.cli.main import main

sys.exit(main())
