use std::io::Read;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use nodeguard::agent::{self, AgentConfig};
use nodeguard::cli::{Cli, Command, LogFormat, Output, RunArgs};
use nodeguard::policy::{self, NodeGuardPolicy};
use nodeguard::retire::{self, RetireCtx};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run(*args),
        Command::DefaultPolicy => {
            let mut value = serde_json::to_value(policy::defaults::default_policy())
                .expect("a policy serializes");
            if let Some(obj) = value.as_object_mut() {
                obj.remove("status");
            }
            print!(
                "{}",
                serde_saphyr::to_string(&value).expect("a policy serializes to YAML")
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Crd => {
            print!("{}", NodeGuardPolicy::crd_yaml());
            Ok(ExitCode::SUCCESS)
        }
        Command::Check {
            files,
            replay,
            year,
        } => check(&files, replay.as_deref(), year),
        Command::ImportNpd { files, name } => import_npd(&files, &name),
        Command::Status {
            node,
            output,
            events,
            kubeconfig,
        } => status(&node, output, events, kubeconfig.as_deref()),
        Command::Retire {
            namespace,
            selector,
            timeout_seconds,
            strict,
            kubeconfig,
        } => retire(
            &namespace,
            &selector,
            std::time::Duration::from_secs(timeout_seconds),
            strict,
            kubeconfig.as_deref(),
        ),
        Command::Keep { socket, log } => {
            init_logging(log.log_format);
            nodeguard::shutdown::keep::serve(&socket)
                .with_context(|| format!("cannot serve {}", socket.display()))
                .map(|()| ExitCode::SUCCESS)
        }
        Command::HandoverHold {
            state_dir,
            seconds,
            why,
            log,
        } => {
            init_logging(log.log_format);
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("cannot start the async runtime")
                .and_then(|rt| {
                    rt.block_on(nodeguard::shutdown::holder::hold(
                        &state_dir,
                        std::time::Duration::from_secs(seconds),
                        &why,
                    ))
                    .context("the handover's delay inhibitor")
                })
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Version => {
            println!("{}", nodeguard::version_string());
            Ok(ExitCode::SUCCESS)
        }
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::from(2)
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    init_logging(args.log.log_format);
    if let Some(root) = &args.command_root {
        // Said once here, not as a puzzling "No such file" of each
        // command (the chart's host.plugins.hostRoot mounts it).
        anyhow::ensure!(
            root.join("bin").is_dir() || root.join("usr").is_dir(),
            "--command-root {}: not a root file system (no bin or usr directory under it); in the chart, host.plugins.hostRoot mounts the node's at /host",
            root.display()
        );
        // CAP_SYS_CHROOT (18) in the effective set, or every command would
        // fail alike with "Operation not permitted".
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let effective = status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok());
        anyhow::ensure!(
            effective.is_none_or(|caps| caps & (1 << 18) != 0),
            "--command-root {}: this process lacks CAP_SYS_CHROOT, which changing into it needs (the chart adds it with host.plugins.hostRoot; an admission policy or runtime may have dropped it)",
            root.display()
        );
    }
    // Read the service manager's environment once, before any thread starts.
    let notify_socket = std::env::var("NOTIFY_SOCKET").ok();
    let systemd_watchdog = nodeguard::watchdog::core::systemd_timeout(
        std::env::var("WATCHDOG_USEC").ok().as_deref(),
        std::env::var("WATCHDOG_PID").ok().as_deref(),
        std::process::id(),
    )
    .context("cannot serve the systemd watchdog")?;
    // A delay inhibitor a killed predecessor left with its keeper: taken
    // back now, while this is the only thread.
    let (keeper, reclaimed) = nodeguard::shutdown::keep::at_start(
        args.inhibitor_keeper.as_deref(),
        notify_socket.as_deref(),
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let result = runtime.block_on(async {
        tracing::info!(version = %nodeguard::version_string(), node = %args.node_name, "starting");
        let client = nodeguard::k8s::client(args.kubeconfig.as_deref()).await?;
        let mut config = AgentConfig::new(&args.node_name, args.listen, &args.state_dir);
        config.report.heartbeat = std::time::Duration::from_secs(args.condition_heartbeat_seconds);
        config.report.policy_spread =
            std::time::Duration::from_secs(args.policy_write_spread_seconds);
        config.trust = args.trust.trust();
        config.notify_socket = notify_socket;
        config.systemd_watchdog = systemd_watchdog;
        config.keeper = keeper;
        config.handover.life = (args.inhibitor_handover_seconds > 0)
            .then(|| std::time::Duration::from_secs(args.inhibitor_handover_seconds));
        config.handover.host_state_dir = args.host_state_dir.clone();
        config.command_root = nodeguard::command::CommandRoot::new(
            args.command_root.clone(),
            config.trust.commands.clone(),
        );
        config.release_executable_pages = !args.keep_executable_pages;
        let retiring_flag = config.handover.retiring.clone();
        *config.reclaimed_inhibitor.lock().unwrap() = reclaimed;
        if let Ok(ns) = std::env::var("POD_NAMESPACE")
            && !ns.is_empty()
        {
            config.lease_namespace = ns;
        }
        config.system_bus_address = std::env::var("DBUS_SYSTEM_BUS_ADDRESS")
            .ok()
            .filter(|a| !a.is_empty());
        // In the chart's pod: the pod the uninstall hook asks to retire.
        let retiring = own_pod().map(|pod| RetireCtx {
            client: nodeguard::k8s::deadline::with_deadline(
                client.clone(),
                nodeguard::k8s::deadline::API_DEADLINE,
            ),
            node_name: args.node_name.clone(),
            pod,
            state_dir: args.state_dir.clone(),
            drop_in_dirs: config.trust.logind_drop_in_dirs.clone(),
            system_bus_address: config.system_bus_address.clone(),
        });
        if let Some(ctx) = &retiring
            && retire::kube::asked_already(&ctx.client, &ctx.pod).await
        {
            // A container restarted after its agent retired: nothing of
            // the agent starts again.
            tracing::warn!(pod = %ctx.pod, "this pod was asked to retire (helm uninstall): nodeguard does not start again; removing what is left of it");
            retire::clean_up(ctx).await;
            let mut signals = Signals::new()?;
            retire::idle(args.listen, async move {
                signals.recv().await;
            })
            .await?;
            return Ok(ExitCode::SUCCESS);
        }
        let agent = agent::start(config, client).await?;
        // Listening from here on, so a second signal that comes while the
        // stop waits (for the shutdown manager's answer, for a shutdown's
        // groups) is not lost.
        let mut signals = Signals::new()?;
        let asked = {
            let pods = agent.pods.clone();
            let retire_asked = async {
                match &retiring {
                    Some(ctx) => retire::requested(pods, &ctx.pod).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                signal = signals.recv() => Some(signal),
                () = retire_asked => None,
            }
        };
        match (asked, retiring) {
            (None, Some(ctx)) => {
                tracing::warn!(pod = %ctx.pod, "asked to retire (helm uninstall): stopping, then removing what nodeguard put on this node");
                // Going for good: no lock is handed over to a next agent.
                retiring_flag.store(true, std::sync::atomic::Ordering::SeqCst);
                agent
                    .stop_after_node_shutdown(async {
                        signals.recv().await;
                    })
                    .await;
                retire::clean_up(&ctx).await;
                retire::idle(args.listen, async move {
                    signals.recv().await;
                })
                .await?;
            }
            (signal, _) => {
                tracing::info!(signal, "stopping");
                agent
                    .stop_after_node_shutdown(async move {
                        signals.recv().await;
                    })
                    .await;
            }
        }
        tracing::info!("stopped");
        Ok(ExitCode::SUCCESS)
    });
    // Blocking work still running (a write to a hung state directory) does
    // not hold the exit: the kubelet would kill the pod at its grace.
    runtime.shutdown_timeout(std::time::Duration::from_secs(2));
    result
}

/// The agent's own pod (`namespace/name`) from the downward API
/// (`POD_NAMESPACE`, `POD_NAME`); `None` outside a pod.
fn own_pod() -> Option<String> {
    let var = |k| std::env::var(k).ok().filter(|v: &String| !v.is_empty());
    Some(format!("{}/{}", var("POD_NAMESPACE")?, var("POD_NAME")?))
}

fn retire(
    namespace: &str,
    selector: &str,
    timeout: std::time::Duration,
    strict: bool,
    kubeconfig: Option<&std::path::Path>,
) -> anyhow::Result<ExitCode> {
    let runtime = one_thread_runtime()?;
    runtime.block_on(async {
        let client = nodeguard::k8s::client(kubeconfig).await?;
        let client =
            nodeguard::k8s::deadline::with_deadline(client, nodeguard::k8s::deadline::API_DEADLINE);
        let say = |line: &str| println!("retire: {line}");
        let progress =
            nodeguard::retire::hook::run(&client, namespace, selector, timeout, say).await?;
        let mut left: Vec<(String, String)> = progress.incomplete.clone();
        for node in &progress.waiting {
            left.push((
                node.clone(),
                format!(
                    "nodeguard was uninstalled, but its agent on this node did not answer within {}s (the node down or unreachable?): nodeguard's conditions, taints, logind drop-in and state may still be on it; README, \"Uninstalling\", says how to remove them",
                    timeout.as_secs()
                ),
            ));
        }
        for (node, report) in &left {
            println!("retire: {node}: {report}");
            if let Err(e) = nodeguard::retire::hook::warn_node(&client, node, report).await {
                println!("retire: {node}: cannot write the Warning Event on the node: {e}");
            }
        }
        if left.is_empty() {
            println!("retire: every running agent removed what nodeguard had put on its node");
            Ok(ExitCode::SUCCESS)
        } else if strict {
            println!(
                "retire: stopping the uninstall (uninstall.strict); fix the nodes above and run it again, or go on without this step: helm uninstall --no-hooks"
            );
            Ok(ExitCode::from(1))
        } else {
            println!(
                "retire: {} node(s) keep something of nodeguard's (each has a NodeguardNotRetired Warning Event); the uninstall goes on",
                left.len()
            );
            Ok(ExitCode::SUCCESS)
        }
    })
}

/// SIGTERM and SIGINT, each delivery seen once.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Signals {
            term: signal(SignalKind::terminate()).context("cannot handle SIGTERM")?,
            int: signal(SignalKind::interrupt()).context("cannot handle SIGINT")?,
        })
    }

    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

/// The runtime of a one-shot command (`status`, `retire`).
fn one_thread_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

fn status(
    node: &str,
    output: Output,
    events: usize,
    kubeconfig: Option<&std::path::Path>,
) -> anyhow::Result<ExitCode> {
    let runtime = one_thread_runtime()?;
    runtime.block_on(async {
        let client = nodeguard::k8s::client(kubeconfig).await?;
        let view = nodeguard::node_view::kube::fetch(&client, node, events).await?;
        match output {
            Output::Table => print!("{}", nodeguard::node_view::render(&view)),
            Output::Json => println!("{}", serde_json::to_string_pretty(&view)?),
        }
        Ok(ExitCode::SUCCESS)
    })
}

fn import_npd(files: &[std::path::PathBuf], name: &str) -> anyhow::Result<ExitCode> {
    let mut imported_all = Vec::new();
    for file in files {
        let origin = file.display().to_string();
        let text =
            std::fs::read_to_string(file).with_context(|| format!("cannot read {origin}"))?;
        let config: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{origin} is not valid JSON"))?;
        let imported = policy::npd::import(&origin, &config);
        for note in &imported.notes {
            eprintln!("note: {note}");
        }
        imported_all.push((origin, imported.monitors));
    }
    let (monitors, notes) = policy::npd::combine(imported_all);
    for note in &notes {
        eprintln!("note: {note}");
    }
    if monitors.is_empty() {
        eprintln!("error: nothing could be imported");
        return Ok(ExitCode::from(1));
    }
    let policy = NodeGuardPolicy::new(
        name,
        policy::NodeGuardPolicySpec {
            monitors,
            ..Default::default()
        },
    );
    let mut value = serde_json::to_value(&policy)?;
    if let Some(obj) = value.as_object_mut() {
        obj.remove("status");
    }
    print!("{}", serde_saphyr::to_string(&value)?);
    let problems = policy::validate(&policy);
    for p in &problems {
        eprintln!("warning: the imported policy has a problem: {p}");
    }
    Ok(if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn check(
    files: &[std::path::PathBuf],
    replay: Option<&std::path::Path>,
    year: Option<i16>,
) -> anyhow::Result<ExitCode> {
    let mut problems = 0usize;
    let mut policies = 0usize;
    let mut monitors = Vec::new();
    for file in files {
        let origin = file.display().to_string();
        let text = if origin == "-" {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("cannot read stdin")?;
            s
        } else {
            std::fs::read_to_string(file).map_err(|source| policy::PolicyError::Read {
                path: origin.clone(),
                source,
            })?
        };
        let docs = match policy::load_policies(&origin, &text) {
            Ok(docs) => docs,
            Err(err) => {
                println!("{err}");
                problems += 1;
                continue;
            }
        };
        for doc in docs {
            policies += 1;
            let name = doc.name.as_deref().unwrap_or("<unnamed>");
            if doc.problems.is_empty() {
                println!("{origin}: NodeGuardPolicy {name}: valid");
                if let Some(p) = &doc.policy {
                    monitors.extend(p.spec.monitors.iter().cloned());
                }
            }
            // Not problems: each node decides. Said here so the author
            // knows before a node refuses it.
            for r in doc
                .policy
                .iter()
                .flat_map(|p| policy::NodeTrust::default().refusals(p))
            {
                println!(
                    "{origin}: NodeGuardPolicy {name}: note: {} {}; nodes with the default trust refuse its {} (their owners allow it with {}, chart value {})",
                    r.field,
                    r.asks,
                    r.dropped,
                    r.setting.flag(),
                    r.setting.chart_value()
                );
            }
            for p in &doc.problems {
                println!(
                    "{origin}: NodeGuardPolicy {name} (document {}): {p}",
                    doc.index + 1
                );
                problems += 1;
            }
        }
    }
    if problems > 0 {
        println!(
            "{problems} problem(s) in {policies} polic{}",
            if policies == 1 { "y" } else { "ies" }
        );
        // With --replay, 1 means "nothing fired": a broken policy is 2.
        return Ok(ExitCode::from(if replay.is_some() { 2 } else { 1 }));
    }
    let Some(log) = replay else {
        return Ok(ExitCode::SUCCESS);
    };
    use std::io::BufRead;
    let file =
        std::fs::File::open(log).with_context(|| format!("cannot read {}", log.display()))?;
    // Streamed a line at a time; bytes that are not UTF-8 are replaced.
    let lines = std::io::BufReader::new(file)
        .split(b'\n')
        .map_while(Result::ok)
        .map(|l| {
            let l = l.strip_suffix(b"\r").unwrap_or(&l);
            String::from_utf8_lossy(l).into_owned()
        });
    let year = year.unwrap_or_else(|| jiff::Zoned::now().year());
    println!(
        "\nreplaying {} over {} monitor(s):\n",
        log.display(),
        monitors.len()
    );
    let result = nodeguard::monitor::replay::replay(&monitors, lines, year);
    print!("{}", nodeguard::monitor::replay::render(&result));
    Ok(if result.fired() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
