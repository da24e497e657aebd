module local.test/pause

go 1.22
