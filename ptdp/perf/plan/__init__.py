"""The layout search behind `ptdp plan`: the candidate layouts, the
dimensions its flags fix, and the search that prices and ranks them."""
