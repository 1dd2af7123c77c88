from snapctl.cli import main

main()
