"""`python -m tandem.cli`: the tandem command line."""
from tandem.cli.main import main

raise SystemExit(main())
