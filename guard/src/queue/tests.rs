//! The scheduler under tokio's paused clock.

use std::{sync::Arc, time::Duration};

use super::*;
use crate::config::{ClassConfig, Config};

const SECOND: Duration = Duration::from_secs(1);

fn config(capacity: u32) -> Config {
    let mut config = Config::default();
    config.upstream.max_concurrency = capacity;
    config.estimate.initial_service_ms = 1_000;
    config.class.insert(
        "interactive".to_owned(),
        ClassConfig::new(0, 3, Some(2_500)),
    );
    config
        .class
        .insert("batch".to_owned(), ClassConfig::new(10, 2, None));
    config
}

fn scheduler(capacity: u32) -> Arc<Scheduler> {
    Scheduler::new(&config(capacity), Metrics::new())
}

async fn granted(ticket: Ticket) -> Permit {
    ticket.wait().await.expect("granted")
}

/// Whether the ticket's permit has been sent (without waiting for it).
fn is_granted(ticket: &mut Ticket) -> bool {
    ticket.is_granted()
}

fn job(class: &str, model: Option<&str>) -> Job {
    Job {
        class: class.to_owned(),
        model: model.map(str::to_owned),
        tokens: None,
        preemptible: false,
        flow: 0,
        prompt_tokens: 0,
    }
}

#[tokio::test(start_paused = true)]
async fn a_small_flow_is_served_in_turn_with_a_large_one() {
    let mut config = config(1);
    if let Some(batch) = config.class.get_mut("batch") {
        batch.max_queue = 100;
        batch.max_queue_per_flow = Some(50);
    }
    let scheduler = Scheduler::new(&config, Metrics::new());
    let of = |flow| Job {
        flow,
        ..job("batch", None)
    };
    let mut line: Vec<(Ticket, u64)> = Vec::new();
    // The first starts at once; fifty more wait.
    for _ in 0..51 {
        line.push((scheduler.enqueue(of(1)).expect("admit"), 1));
    }
    assert_eq!(
        scheduler.enqueue(of(1)).expect_err("per-flow limit").reason,
        RejectReason::QueueFull
    );
    for _ in 0..5 {
        line.push((scheduler.enqueue(of(2)).expect("admit"), 2));
    }
    // Serve one at a time and note whose turn it was.
    let mut served = Vec::new();
    while !line.is_empty() {
        let at = line
            .iter_mut()
            .position(|(ticket, _)| is_granted(ticket))
            .expect("one is granted");
        let (ticket, flow) = line.remove(at);
        served.push(flow);
        drop(granted(ticket).await);
    }
    let small_last = served.iter().rposition(|f| *f == 2).expect("served");
    assert!(
        small_last < 10,
        "the small flow's last job came {}th: {served:?}",
        small_last + 1
    );
}

#[tokio::test(start_paused = true)]
async fn a_preemptible_request_gives_its_slot_to_a_more_urgent_one_and_goes_on_first() {
    let scheduler = scheduler(1);
    let preemptible = Job {
        preemptible: true,
        ..job("batch", None)
    };
    let running = granted(scheduler.enqueue(preemptible.clone()).expect("admit")).await;
    let mut later_batch = scheduler.enqueue(job("batch", None)).expect("admit");
    // The same class never preempts.
    assert!(
        tokio::time::timeout(SECOND / 10, running.progress().preempted())
            .await
            .is_err()
    );
    let mut urgent = scheduler.enqueue(job("interactive", None)).expect("admit");
    running.progress().preempted().await;
    assert!(!is_granted(&mut urgent), "the slot comes back first");
    let mut paused = running.requeue(Instant::now());
    assert!(is_granted(&mut urgent));
    let snapshot = scheduler.snapshot();
    let batch = snapshot.iter().find(|c| c.name == "batch").expect("batch");
    assert_eq!((batch.queued, batch.paused), (2, 1));
    drop(granted(urgent).await);
    assert!(
        is_granted(&mut paused),
        "the paused request goes on before later batch work"
    );
    assert!(!is_granted(&mut later_batch));
}

#[tokio::test(start_paused = true)]
async fn a_running_job_that_may_be_stopped_does_not_count_against_an_urgent_deadline() {
    let mut config = config(1);
    // Each batch job is expected to run 5 s; a chat must start within 2.5 s.
    config.estimate.initial_service_ms = 5_000;
    let scheduler = Scheduler::new(&config, Metrics::new());
    let long = |preemptible| Job {
        preemptible,
        ..job("batch", None)
    };
    let running = granted(scheduler.enqueue(long(false)).expect("admit")).await;
    let refused = scheduler.enqueue(job("interactive", None));
    assert_eq!(
        refused.expect_err("it cannot start in time").reason,
        RejectReason::DeadlinePredicted
    );
    drop(running);
    let running = granted(scheduler.enqueue(long(true)).expect("admit")).await;
    let _urgent = scheduler
        .enqueue(job("interactive", None))
        .expect("admitted: the batch job will be stopped for it");
    running.progress().preempted().await;
}

#[tokio::test(start_paused = true)]
async fn a_request_about_to_end_is_left_to_finish_until_it_runs_past_its_estimate() {
    let mut config = config(1);
    config.risk.preempt_grace_ms = 2_000;
    let scheduler = Scheduler::new(&config, Metrics::new());
    let preemptible = Job {
        preemptible: true,
        ..job("batch", None)
    };
    // Its estimate (1 s) lies within the grace: left to finish while it keeps to it...
    let running = granted(scheduler.enqueue(preemptible).expect("admit")).await;
    let _urgent = scheduler.enqueue(job("interactive", None)).expect("admit");
    let started = Instant::now();
    assert!(
        tokio::time::timeout(SECOND / 2, running.progress().preempted())
            .await
            .is_err()
    );
    // ...and stopped once it runs past it, without another request arriving to look again.
    running.progress().preempted().await;
    let stopped = started.elapsed();
    assert_eq!(
        stopped, SECOND,
        "stopped the instant it passed its estimate"
    );
}

#[tokio::test(start_paused = true)]
async fn after_its_longest_pause_a_request_runs_min_run_then_yields_again() {
    let mut config = config(1);
    config.risk.max_throttle_ms = 5_000;
    config.risk.min_run_ms = 1_000;
    config.risk.preempt_grace_ms = 0;
    let scheduler = Scheduler::new(&config, Metrics::new());
    let preemptible = Job {
        preemptible: true,
        ..job("batch", None)
    };
    let running = granted(scheduler.enqueue(preemptible).expect("admit")).await;
    let first = scheduler.enqueue(job("interactive", None)).expect("admit");
    running.progress().preempted().await;
    let paused = running.requeue(Instant::now());
    let first = granted(first).await;
    // Urgent work keeps coming past the longest pause: the paused request goes next all the same.
    tokio::time::advance(Duration::from_secs(6)).await;
    let mut second = scheduler.enqueue(job("interactive", None)).expect("admit");
    drop(first);
    assert!(!is_granted(&mut second), "the overdue request goes first");
    let resumed = granted(paused).await;
    let went_on = Instant::now();
    // It runs its bounded run, then yields to the urgent request again.
    resumed.progress().preempted().await;
    let ran = went_on.elapsed();
    assert_eq!(ran, SECOND, "it ran its bounded run, then yielded at once");
}

#[tokio::test(start_paused = true)]
async fn higher_priority_goes_first_fifo_within_a_class() {
    let scheduler = scheduler(1);
    let running = granted(scheduler.enqueue(job("batch", None)).expect("admit")).await;
    let mut batch = scheduler.enqueue(job("batch", None)).expect("admit");
    let mut first = scheduler.enqueue(job("interactive", None)).expect("admit");
    let mut second = scheduler.enqueue(job("interactive", None)).expect("admit");
    assert!(!is_granted(&mut batch) && !is_granted(&mut first));

    drop(running);
    assert!(
        is_granted(&mut first),
        "interactive before the earlier batch"
    );
    assert!(!is_granted(&mut second) && !is_granted(&mut batch));
    drop(granted(first).await);
    assert!(is_granted(&mut second), "FIFO within the class");
    assert!(
        !is_granted(&mut batch),
        "batch never starts while interactive waits"
    );
    drop(granted(second).await);
    assert!(is_granted(&mut batch));
    assert_eq!(scheduler.load(), (0, 1));
}

#[tokio::test(start_paused = true)]
async fn a_full_class_is_refused_with_a_retry_hint() {
    let scheduler = scheduler(1);
    let _running = granted(scheduler.enqueue(job("batch", None)).expect("admit")).await;
    let _a = scheduler.enqueue(job("batch", None)).expect("admit");
    let _b = scheduler.enqueue(job("batch", None)).expect("admit");
    let rejection = scheduler.enqueue(job("batch", None)).expect_err("full");
    assert_eq!(rejection.reason, RejectReason::QueueFull);
    // The head of the batch queue starts when the running request ends: in one second.
    assert_eq!(rejection.retry_after, SECOND);
    // Another class is not affected.
    assert!(scheduler.enqueue(job("interactive", None)).is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_deadline_that_cannot_be_met_is_refused_on_arrival() {
    let scheduler = scheduler(1);
    let _running = granted(scheduler.enqueue(job("interactive", None)).expect("admit")).await;
    // Each takes about a second (the prior); the deadline is 2.5 s.
    let _a = scheduler
        .enqueue(job("interactive", None))
        .expect("starts at 1 s");
    let _b = scheduler
        .enqueue(job("interactive", None))
        .expect("starts at 2 s");
    let rejection = scheduler
        .enqueue(job("interactive", None))
        .expect_err("would start at 3 s");
    assert_eq!(rejection.reason, RejectReason::DeadlinePredicted);
    assert_eq!(rejection.retry_after, Duration::from_millis(500));
    // Time passes: the running request's remaining time shrinks, so the prediction does too.
    tokio::time::advance(Duration::from_millis(600)).await;
    assert!(scheduler.enqueue(job("interactive", None)).is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_waiting_request_past_its_deadline_leaves_the_queue() {
    let scheduler = scheduler(1);
    let running = granted(scheduler.enqueue(job("interactive", None)).expect("admit")).await;
    let waiting = scheduler.enqueue(job("interactive", None)).expect("admit");
    let started = Instant::now();
    let rejection = waiting.wait().await.expect_err("deadline passes");
    assert_eq!(rejection.reason, RejectReason::DeadlineExpired);
    assert_eq!(started.elapsed(), Duration::from_millis(2_500));
    assert_eq!(scheduler.load(), (0, 1), "out of the queue");
    drop(running);
    assert_eq!(scheduler.load(), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_dropped_ticket_leaves_the_queue_and_a_late_permit_is_returned() {
    let scheduler = scheduler(1);
    let running = granted(scheduler.enqueue(job("batch", None)).expect("admit")).await;
    let gone = scheduler.enqueue(job("batch", None)).expect("admit");
    drop(gone);
    assert_eq!(
        scheduler.load(),
        (0, 1),
        "the dropped request left the queue"
    );

    // Granted, then dropped before it was taken: the slot must come back.
    let mut unlucky = scheduler.enqueue(job("batch", None)).expect("admit");
    let mut next = scheduler.enqueue(job("batch", None)).expect("admit");
    drop(running);
    assert!(is_granted(&mut unlucky));
    drop(unlucky);
    assert!(
        is_granted(&mut next),
        "the returned permit went to the next request"
    );
    assert_eq!(scheduler.load(), (0, 1));
}

#[tokio::test(start_paused = true)]
async fn the_estimate_learns_from_completions() {
    let scheduler = scheduler(1);
    for _ in 0..5 {
        let permit = granted(
            scheduler
                .enqueue(job("interactive", Some("m")))
                .expect("admit"),
        )
        .await;
        tokio::time::advance(Duration::from_millis(200)).await;
        permit.complete(None, None);
    }
    let _running = granted(
        scheduler
            .enqueue(job("interactive", Some("m")))
            .expect("admit"),
    )
    .await;
    // At 0.2 s each, many fit within the 2.5 s deadline; the 1 s prior would allow two.
    let admitted: Vec<_> = (0..3)
        .map(|_| {
            scheduler
                .enqueue(job("interactive", Some("m")))
                .expect("fits")
        })
        .collect();
    assert_eq!(admitted.len(), 3);
    let snapshot = scheduler.snapshot();
    let interactive = snapshot
        .iter()
        .find(|c| c.name == "interactive")
        .expect("class");
    assert_eq!(interactive.predicted_wait_ms, 800);
}

#[tokio::test(start_paused = true)]
async fn shutting_down_turns_waiters_and_newcomers_away() {
    let scheduler = scheduler(1);
    let _running = granted(scheduler.enqueue(job("batch", None)).expect("admit")).await;
    let waiting = scheduler.enqueue(job("batch", None)).expect("admit");
    scheduler.shut_down();
    let rejection = waiting.wait().await.expect_err("rejected");
    assert_eq!(rejection.reason, RejectReason::ShuttingDown);
    let newcomer = scheduler
        .enqueue(job("interactive", None))
        .expect_err("rejected");
    assert_eq!(newcomer.reason, RejectReason::ShuttingDown);
}

#[tokio::test(start_paused = true)]
async fn held_classes_wait_until_the_hold_lifts() {
    let scheduler = scheduler(2);
    scheduler.hold_above(Some(0));
    let mut batch = scheduler.enqueue(job("batch", None)).expect("admit");
    assert!(
        !is_granted(&mut batch),
        "held while at risk, though a slot is free"
    );
    let _interactive = granted(scheduler.enqueue(job("interactive", None)).expect("admit")).await;
    scheduler.hold_above(None);
    assert!(is_granted(&mut batch));
}

#[tokio::test(start_paused = true)]
async fn reload_changes_limits_and_keeps_the_queue() {
    let scheduler = scheduler(1);
    let running = granted(scheduler.enqueue(job("batch", None)).expect("admit")).await;
    let mut waiting = scheduler.enqueue(job("batch", None)).expect("admit");
    let mut next = config(2);
    next.class.remove("batch");
    scheduler.reconfigure(&next);
    assert!(
        is_granted(&mut waiting),
        "capacity grew: the queued request starts"
    );
    let refused = scheduler
        .enqueue(job("batch", None))
        .expect_err("class removed");
    assert_eq!(refused.reason, RejectReason::ShuttingDown);
    drop(running);
    drop(granted(waiting).await);
    assert!(
        scheduler.snapshot().iter().all(|c| c.name != "batch"),
        "a removed class goes once drained"
    );
}

#[tokio::test(start_paused = true)]
async fn a_long_line_is_predicted_from_its_sums_as_the_short_one_is_slot_by_slot() {
    let mut config = config(2);
    if let Some(batch) = config.class.get_mut("batch") {
        batch.max_queue = 2_000;
    }
    let scheduler = Scheduler::new(&config, Metrics::new());
    let mut tickets = Vec::new();
    let mut predicted = Vec::new();
    // Every request costs the 1 s prior; two slots: the n-th waiting starts after n/2 s.
    for _ in 0..1_000 {
        let ticket = scheduler.enqueue(job("batch", None)).expect("room");
        predicted.push(ticket.predicted());
        tickets.push(ticket);
    }
    for (n, predicted) in predicted.iter().enumerate() {
        let waiting_ahead = n.saturating_sub(2) as f64;
        let exact = (waiting_ahead / 2.0).ceil() + f64::from(u8::from(n >= 2));
        let error = (predicted.as_secs_f64() - exact).abs();
        assert!(
            error <= 1.0,
            "request {n}: predicted {predicted:?}, slot by slot {exact} s"
        );
    }
    // The one at the end of the line, as /status shows it, from the sums.
    let batch = scheduler
        .snapshot()
        .into_iter()
        .find(|c| c.name == "batch")
        .expect("batch");
    assert_eq!(batch.queued, 998);
    assert!(
        (499_000..=500_000).contains(&batch.predicted_wait_ms),
        "{}",
        batch.predicted_wait_ms
    );
}
