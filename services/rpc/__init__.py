"""Generated gRPC stubs, committed (`make proto` writes them again); never edited by hand."""
