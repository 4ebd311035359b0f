// Command kube-scheduler is the upstream scheduler, built from the
// k8s.io/kubernetes module: it binds the DaemonSet's and the workloads' pods
// to the test VM's node.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func main() {
	os.Exit(cli.Run(app.NewSchedulerCommand()))
}
