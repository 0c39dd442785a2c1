from bench.throughput import main

main()
