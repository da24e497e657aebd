// Command pause is the process every pod sandbox runs (what registry.k8s.io/pause provides): it
// holds the pod's namespaces open and exits on SIGINT or SIGTERM. Built here because the local
// node pulls nothing.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	// Reap children re-parented to us (the pod shares its PID namespace only when asked to).
	signal.Ignore(syscall.SIGCHLD)
	<-stop
}
