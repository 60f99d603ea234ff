from mirrorgrad.cli import main

raise SystemExit(main())
