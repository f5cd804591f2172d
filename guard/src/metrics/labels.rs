//! Every label set guard's metrics use, by name: the vocabulary of docs/design.md §7.

use super::family::label_sets;

label_sets! {
    /// A class's series.
    ByClass => Class { class }
    /// `guard_requests_total`: a class's final outcomes.
    ByClassOutcome => ClassOutcome { class, outcome }
    /// A class's rejections by reason.
    ByClassReason => ClassReason { class, reason }
    /// `guard_reaped_total`: where a class's requests were when their client left.
    ByClassStage => ClassStage { class, stage }
    /// `guard_timed_out_total`: which of a class's limits ran out.
    ByClassWhich => ClassWhich { class, which }
    /// A class's series by kind (failures, tokens, resumes).
    ByClassKind => ClassKind { class, kind }
    /// `guard_jobs_total`: valid or invalid.
    ByClassResult => ClassResult { class, result }
    /// `guard_prompt_tokens_total`: computed or cached.
    ByClassSource => ClassSource { class, source }
    /// `guard_remote_refused_total`.
    ByClassModel => ClassModel { class, model }
    /// `guard_throttle_changes_total`.
    ByClassChange => ClassChange { class, change, reason }
    /// `guard_classified_total`: how a class was decided.
    ByClassBy => ClassBy { class, by }
    /// `guard_class_claims_refused_total`: a class asked for and the class given.
    ByClaim => Claim { claimed, class }
    /// A series by reason (invalid requests, risk signals).
    ByReason => Reason { reason }
    /// A model's series.
    ByModel => Model { model }
    /// `guard_passthrough_requests_total`: the upstream's status code.
    ByCode => Code { code }
    /// `guard_config_reloads_total`.
    ByResult => Reload { result }
    /// `guard_connections_refused_total`.
    ByListener => Listener { listener }
    /// A host resource's series (swap, memory).
    ByResource => Resource { resource }
    /// A GPU's series.
    ByGpu => Gpu { gpu }
    /// A GPU's throttle reasons.
    ByGpuReason => GpuReason { gpu, reason }
    /// A process's memory on a GPU.
    ByGpuPid => GpuPid { gpu, pid }
}
