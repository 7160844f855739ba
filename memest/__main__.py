from memest.cli import main

main()
