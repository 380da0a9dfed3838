from .segment import main

raise SystemExit(main())
