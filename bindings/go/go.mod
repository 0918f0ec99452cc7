module strata.example/strata

go 1.19
