from capture_proxy.cli import main

raise SystemExit(main())
