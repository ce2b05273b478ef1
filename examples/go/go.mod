module github.com/vcpo-rl/vcpo-rl/examples/go

go 1.19
