"""Generated gRPC stubs (`make proto`); never edited by hand."""
